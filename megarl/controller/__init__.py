"""The single controller: resource pools on Ray placement groups, worker groups of Ray actors that
form one torch.distributed world each, and typed dispatch of batches to them.

Only this package (and the workers it starts) imports Ray. Roles (policy, critic, ...) are plain
classes that run inside the worker processes; see :mod:`megarl.controller.role`.
"""

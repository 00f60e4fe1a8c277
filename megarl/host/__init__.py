"""Set-up of megarl's host processes (the driver, its Ray daemons and workers) before they run:
the host memory allocator (:mod:`megarl.host.allocator`) and the fork server helper processes start from
(:mod:`megarl.host.forkserver`). Pure of Ray, torch and megatron-core:
standard library and ``megarl.errors`` only, so the CLI can use it before anything heavy is imported."""

"""The weight link's timeouts: init_s for its rendezvous, collective_s for its exchanges (a link of one rank,
in process). An async push waits on the link behind the rollout pool's generation, which outlasts init_s."""

from __future__ import annotations

import datetime

from megarl.controller.spec import Timeouts
from megarl.roles.split import _LinkMember


def test_weight_link_waits_collective_s_and_its_rendezvous_init_s():
    timeouts = Timeouts(init_s=7.0, collective_s=2400.0)
    member = _LinkMember()  # what PolicyRole.open_weight_link / join_weight_link hold
    host, port = member.open("127.0.0.1", timeouts)
    member.join(host, port, 0, 1, "cpu", timeouts)
    link = member.get()
    try:
        assert link.pg.options._timeout == datetime.timedelta(seconds=2400)  # gloo's own copy of the timeout
        assert link._store.timeout == datetime.timedelta(seconds=7)  # the rendezvous store
    finally:
        link.close()

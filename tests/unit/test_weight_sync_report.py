"""The driver's report of one weight sync over many ranks (megarl.roles.results.WeightSync.slowest): the byte counts
must not depend on which rank happened to be slowest (a resumed run compares its metrics with its uninterrupted
twin's). Hand-worked: two ranks of a TP2 sync whose sent/received counts are mirror images."""

from megarl.resharding.stats import TransferStats
from megarl.roles.results import WeightSync


def _sync(seconds, sent, received, kept):
    return WeightSync(TransferStats(seconds=seconds, bytes_sent=sent, bytes_received=received, bytes_kept=kept,
                                    buckets=3), seconds=seconds, sleep_frees_memory=False)


def test_byte_counts_do_not_follow_the_slowest_rank():
    rank0, rank1 = (100, 60, 1000), (60, 100, 1128)  # (sent, received, kept): rank 1 keeps 128 padded rows more
    for slow in (0, 1):  # either rank the slowest: the same report
        syncs = [_sync(2.0 if r == slow else 1.0, *counts) for r, counts in enumerate((rank0, rank1))]
        m = WeightSync.slowest(syncs).metrics()
        assert m["timing/to_rollout_s"] == 2.0 and m["timing/reshard_s"] == 2.0
        assert (m["reshard/bytes_sent"], m["reshard/bytes_received"], m["reshard/bytes_kept"]) == (100, 100, 1128)
        assert m["reshard/buckets"] == 3

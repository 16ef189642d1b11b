"""txid_snapshot text ('xmin:xmax:xip,...') read in Python, as PostgreSQL reads it."""

from __future__ import annotations


def txid_visible(txid: int, snapshot: str) -> bool:
    """txid_visible_in_snapshot(): the transaction had completed when the snapshot was taken."""
    xmin, xmax, xip = snapshot.split(":")
    if txid < int(xmin):
        return True
    if txid >= int(xmax):
        return False
    return str(txid) not in xip.split(",")


def snapshot_xmin(snapshot: str) -> int:
    return int(snapshot.split(":")[0])


def snapshot_xmax(snapshot: str) -> int:
    return int(snapshot.split(":")[1])

"""Which partition a record goes to.

* A record with a key goes to ``crc32c(key) % partitions`` (CRC-32C of the
  raw key bytes, the same checksum as the batch CRC). The mapping depends only
  on the key and the partition count, so it is the same in every client,
  every process and every site, and it is stable for as long as the topic's
  partition count does not change.
* A record without a key goes to the topic's *sticky* partition, which moves
  round-robin to the next partition each time a batch for it is closed
  (Kafka's sticky partitioner): batches fill up instead of spreading single
  records over every partition.
"""

from __future__ import annotations

import crc32c


def key_partition(key: bytes, partitions: int) -> int:
    """The partition of a keyed record: ``crc32c(key) % partitions``."""
    return int(crc32c.crc32c(key)) % partitions


class StickyPartitioner:
    """Round-robin per batch for records without a key."""

    __slots__ = ("current", "_start")

    def __init__(self, start: int = 0) -> None:
        # The producer passes a random start, so that many producers do not
        # all begin on partition 0.
        self._start = start
        self.current: dict[str, int] = {}  # topic -> sticky partition

    def partition(self, topic: str, partitions: int) -> int:
        current = self.current.get(topic)
        if current is None or current >= partitions:
            current = self._start % partitions
            self.current[topic] = current
        return current

    def on_batch_closed(self, topic: str, partition: int, partitions: int) -> None:
        """The batch for ``partition`` closed: move on if it was the sticky one."""
        if self.current.get(topic) == partition:
            self.current[topic] = (partition + 1) % partitions

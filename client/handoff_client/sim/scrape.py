"""The server's own counters, read from its Prometheus endpoint.

Counters start from zero in each process. A coordinator that was killed and
restarted is read as the scrape of its running process plus the scrapes of
the processes it replaced, each taken just before its kill: counters add up
over them, gauges are the running process's.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# Families whose samples count up from zero in each process (but not their
# _created timestamps).
COUNTING = frozenset({"counter", "histogram", "summary"})


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """Samples keyed by name and sorted labels: ``(name, (("result", "success"),))``."""

    samples: Samples
    counting: frozenset[str] = frozenset()  # sample names that count up
    # The processes this one replaced (a crashed coordinator's), each
    # scraped just before its kill, oldest first.
    earlier: tuple[ServerMetrics, ...] = ()

    @property
    def processes(self) -> int:
        return 1 + len(self.earlier)

    def after(self, earlier: Sequence[ServerMetrics]) -> ServerMetrics:
        """This scrape, of a process that replaced the ``earlier`` ones."""
        return replace(self, earlier=tuple(earlier))

    def total(self, name: str) -> float:
        """Summed over every label combination; a counter over every process."""
        return sum(self.by_label(name, "").values())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out = self.latest_by_label(name, label)
        if name in self.counting:
            for scrape in self.earlier:
                for key, value in scrape.latest_by_label(name, label).items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def latest(self, name: str) -> float:
        """The running process's own value, summed over every label combination."""
        return sum(self.latest_by_label(name, "").values())

    def latest_by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (sample, labels), value in self.samples.items():
            if sample == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out


def parse(text: str) -> ServerMetrics:
    samples: Samples = {}
    counting: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
            if family.type in COUNTING and not sample.name.endswith("_created"):
                counting.add(sample.name)
    return ServerMetrics(samples, frozenset(counting))


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The exposition text at ``url`` (blocking); raises OSError (URLError included)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body: bytes = response.read()
    return body.decode()


async def scrape(url: str, timeout_s: float = 5.0) -> ServerMetrics:
    """Fetch and parse ``url``; raises OSError (URLError included) when unreachable."""
    # urllib blocks; a thread keeps the event loop (and the sidecars) running.
    return parse(await asyncio.to_thread(fetch, url, timeout_s))

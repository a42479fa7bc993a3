"""What `mtpserve bench` sends: prompts (bundled code-like text, random token ids, or a file) and
when (closed loop at a concurrency, or Poisson arrivals at a request rate)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

# Code-like prompts of mixed lengths (one line to a page), the traffic MTP drafting helps most.
BUNDLED_PROMPTS = [
    "def fibonacci(n):\n",
    "import numpy as np\n\ndef softmax(x, axis=-1):\n    ",
    "# Return the n-th prime number.\ndef nth_prime(n: int) -> int:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "SELECT customer_id, SUM(amount) AS total\nFROM orders\nWHERE created_at >= '2024-01-01'\n",
    "for (let i = 0; i < items.length; i++) {\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n    for (int i = 1; i < argc; i++) {\n",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n    x: float\n    y: float\n\n"
    "    def distance(self, other: 'Point') -> float:\n",
    "fn parse_line(line: &str) -> Option<(String, u32)> {\n    let mut parts = line.split(',');\n",
    "import json\nimport sys\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and fill in "
    "defaults for missing keys.\"\"\"\n    with open(path) as f:\n        config = json.load(f)\n",
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n    mid = len(xs) // 2\n"
    "    left = merge_sort(xs[:mid])\n    right = merge_sort(xs[mid:])\n",
    "package main\n\nimport (\n\t\"fmt\"\n\t\"net/http\"\n)\n\nfunc handler(w http.ResponseWriter, r *http.Request) {\n",
    "class LRUCache:\n    \"\"\"A fixed-capacity cache that evicts the least recently used key.\"\"\"\n\n"
    "    def __init__(self, capacity: int):\n        self.capacity = capacity\n        self.data = {}\n"
    "        self.order = []\n\n    def get(self, key):\n        if key not in self.data:\n"
    "            return None\n        self.order.remove(key)\n        self.order.append(key)\n"
    "        return self.data[key]\n\n    def put(self, key, value):\n",
    "import torch\nimport torch.nn as nn\n\n\nclass MLP(nn.Module):\n    def __init__(self, d_in, d_hidden, d_out):\n"
    "        super().__init__()\n        self.fc1 = nn.Linear(d_in, d_hidden)\n        self.fc2 = nn.Linear(d_hidden, d_out)\n\n"
    "    def forward(self, x):\n",
    "#!/usr/bin/env bash\nset -euo pipefail\n\n# Back up every .conf file under /etc into a dated tarball.\n"
    "backup_dir=\"/var/backups/$(date +%F)\"\nmkdir -p \"$backup_dir\"\n",
    "def tokenize(text):\n    tokens = []\n    i = 0\n    while i < len(text):\n        c = text[i]\n"
    "        if c.isspace():\n            i += 1\n            continue\n        if c.isdigit():\n"
    "            j = i\n            while j < len(text) and text[j].isdigit():\n                j += 1\n"
    "            tokens.append(('NUM', text[i:j]))\n            i = j\n            continue\n"
    "        if c.isalpha() or c == '_':\n            j = i\n"
    "            while j < len(text) and (text[j].isalnum() or text[j] == '_'):\n                j += 1\n"
    "            tokens.append(('NAME', text[i:j]))\n            i = j\n            continue\n"
    "        if c in '+-*/()=<>':\n",
    "interface User {\n  id: number;\n  name: string;\n  email?: string;\n}\n\n"
    "export async function fetchUsers(baseUrl: string): Promise<User[]> {\n",
]


@dataclass(frozen=True)
class Load:
    """A closed-loop concurrency or an open-loop request rate (exactly one is set)."""
    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def label(self) -> str:
        return f"C={self.concurrency}" if self.concurrency is not None else f"{self.request_rate:g} req/s"


@dataclass(frozen=True)
class Workload:
    """N requests: their prompt token ids (and text, when there is one) and arrival offsets.

    arrivals_s is None for a closed loop (the driver keeps C requests in flight) and sorted
    seconds from the start of the run for an open loop.

    fresh, when set, makes the i-th prompt set (i >= 1; set 0 is ``prompt_ids``): ``per_load``
    gives each load a set of its own, so a prefix cache cannot answer a later load from an
    earlier one (random prompts; a fixed text list repeats by nature). ``warmup_ids``: the prompts
    a warm-up before this workload runs (default: its own first ones). ``output_lens``: each
    request's max_tokens (``output_lengths``), or None for the run's one ``--max-tokens``.
    """
    prompt_ids: list[list[int]]
    prompt_texts: list[str] | None
    arrivals_s: list[float] | None = None
    fresh: Callable[[int], list[list[int]]] | None = field(default=None, compare=False, repr=False)
    warmup_ids: list[list[int]] | None = field(default=None, repr=False)
    output_lens: list[int] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.prompt_ids)

    def max_tokens(self, i: int, default: int) -> int:
        """Request i's max_tokens: its own length, or ``default`` (the run's one length)."""
        return default if self.output_lens is None else self.output_lens[i]

    def with_arrivals(self, arrivals_s: list[float] | None) -> Workload:
        return replace(self, arrivals_s=arrivals_s)

    def prompt_set(self, i: int) -> Workload:
        """The i-th prompt set (0 = this one) as a workload that warms up on set 0."""
        if i == 0 or self.fresh is None:
            return self
        return Workload(self.fresh(i), None, self.arrivals_s, None, self.prompt_ids, self.output_lens)

    def warmup(self, n: int) -> Workload:
        """The first n prompts a warm-up before this workload sends (not this workload's own
        when it has a fresh set: warming on them would turn them into prefix-cache hits)."""
        ids = self.warmup_ids if self.warmup_ids is not None else self.prompt_ids
        texts = self.prompt_texts[:n] if self.prompt_texts and self.warmup_ids is None else None
        return Workload(ids[:n], texts)


class Submitter:
    """When a step-driven benchmark adds each request of a workload under one load.

    Closed loop (a concurrency C): the first C at once, then the next one as each finishes (at
    that time). Open loop (a request rate): each at its scheduled arrival, checked between steps.
    ``submit(i, arrival_s)`` adds request i; ``arrival_s`` is when it was due.
    """

    def __init__(self, workload: Workload, load: Load, submit: Callable[[int, float], None]):
        self.num_requests = workload.num_requests
        self._arrivals = workload.arrivals_s if load.concurrency is None else None
        self._submit = submit
        self.next_index = 0
        if self._arrivals is None:
            for _ in range(min(load.concurrency, self.num_requests)):
                self._add(0.0)

    def _add(self, arrival_s: float) -> None:
        self._submit(self.next_index, arrival_s)
        self.next_index += 1

    def arrive(self, now_s: float) -> None:
        """Open loop: add every request whose arrival time has passed."""
        while self.seconds_to_next_arrival(now_s) == 0.0:
            self._add(self._arrivals[self.next_index])

    def finished(self, now_s: float) -> None:
        """A request finished: a closed loop adds the next one."""
        if self._arrivals is None and self.next_index < self.num_requests:
            self._add(now_s)

    def wait_for_next(self, now_s: float) -> bool:
        """With nothing in flight: sleep until the next open-loop arrival is due and say True, or
        say False when no request is still to come (the run cannot progress)."""
        wait = self.seconds_to_next_arrival(now_s)
        if wait is None:
            return False
        time.sleep(wait)
        return True

    def seconds_to_next_arrival(self, now_s: float) -> float | None:
        """Open loop with requests still to come: seconds until the next is due (0 = due); else None."""
        if self._arrivals is None or self.next_index >= self.num_requests:
            return None
        return max(0.0, self._arrivals[self.next_index] - now_s)


def text_workload(texts: list[str], encode, num_requests: int) -> Workload:
    """Cycle through `texts` until `num_requests`; token ids from `encode(text)`."""
    if not texts:
        raise ValueError("the prompt set is empty")
    chosen = [texts[i % len(texts)] for i in range(num_requests)]
    ids = {t: list(encode(t)) for t in set(chosen)}
    empty = [t for t, v in ids.items() if not v]
    if empty:
        raise ValueError(f"a prompt encodes to no tokens: {empty[0]!r}")
    return Workload([ids[t] for t in chosen], chosen)


def random_workload(num_requests: int, input_len: int, vocab_size: int, seed: int = 0,
                    exclude: tuple[int, ...] = (), prefix: list[int] | None = None) -> Workload:
    """Uniform random token ids in [0, vocab_size), skipping `exclude` (EOS and other specials),
    after a shared `prefix` when given; each further prompt set (``fresh``) is drawn anew."""
    if input_len < 1:
        raise ValueError(f"input length must be >= 1, got {input_len}")
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude, dtype=np.int64))

    def prompt_set(i: int) -> list[list[int]]:
        rng = np.random.default_rng([seed, i] if i else seed)
        return [list(prefix or []) + [int(t) for t in row] for row in rng.choice(allowed, size=(num_requests, input_len))]
    return Workload(prompt_set(0), None, fresh=prompt_set)


def with_shared_prefixes(base: Workload, length: int, num_groups: int, vocab: int, seed: int,
                         exclude: tuple[int, ...]) -> Workload:
    """``base``'s prompts after one of ``num_groups`` random prefixes of ``length`` tokens, request
    i of every prompt set in group ``groups[i]`` (drawn at random, seeded). Each further prompt set
    (``fresh``: one per load) has prefixes of its own, so no load finds another load's prefixes
    cached; set 0's (the warm-up's) group 0 is the single shared prefix of one-group runs."""
    groups = np.random.default_rng([seed, 7]).integers(num_groups, size=base.num_requests)

    def prefixes(i: int) -> list[list[int]]:
        return [random_workload(1, length, vocab, seed + 1 + g if i == 0 else seed + 1000 * i + g,
                                exclude).prompt_ids[0] for g in range(num_groups)]

    def prefixed(i: int, prompts: list[list[int]]) -> list[list[int]]:
        shared = prefixes(i)
        return [shared[g] + p for g, p in zip(groups, prompts)]
    return Workload(prefixed(0, base.prompt_ids), None, base.arrivals_s,
                    fresh=(lambda i: prefixed(i, base.fresh(i))) if base.fresh else None,
                    output_lens=base.output_lens)


def output_lengths(num_requests: int, max_tokens: int, range_ratio: float, seed: int = 0) -> list[int] | None:
    """Each request's output length, drawn uniformly (seeded) from
    [max_tokens * (1 - range_ratio), max_tokens * (1 + range_ratio)], as vLLM's
    ``--random-range-ratio`` draws them; None for 0 (every request ``max_tokens``).

    With one length for all, a closed loop's requests finish in the same step and the next C
    arrive together in one prompt step, a rhythm real traffic does not have: an MTP engine whose
    accepted drafts put some requests a token ahead loses it (each wave then arrives over two
    steps that mix prompts with decoding rows), and so does HTTP, whose arrivals spread out."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"the range ratio must be in [0, 1), got {range_ratio}")
    if range_ratio == 0.0:
        return None
    lo, hi = max(1, round(max_tokens * (1 - range_ratio))), max(1, round(max_tokens * (1 + range_ratio)))
    return [int(n) for n in np.random.default_rng([seed, 11]).integers(lo, hi + 1, size=num_requests)]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` requests/s; the first arrives at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def per_load(workload: Workload, loads, seed: int = 0) -> list[tuple[Load, Workload]]:
    """Pair each load with the workload it runs: its own prompt set when the workload makes fresh
    ones (load i gets set i + 1; set 0 is for warm-ups); open-loop loads get seeded Poisson arrivals."""
    pairs = []
    for i, load in enumerate(loads):
        wl = workload.prompt_set(i + 1)
        if load.concurrency is None:
            wl = wl.with_arrivals(poisson_arrivals(wl.num_requests, load.request_rate, seed))
        pairs.append((load, wl))
    return pairs

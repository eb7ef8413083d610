"""``/metrics`` in the Prometheus text format (version 0.0.4), written out by hand: a few gauges,
counters and histograms need no client library.

The engine thread records (``finished``, the snapshot); the event loop renders. Histograms and the
token-rate window are guarded by one lock; the snapshot is replaced whole, never mutated.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

# seconds; TTFT on a busy CPU reaches seconds, ITL on a GPU a few milliseconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
RATE_WINDOW_S = 10.0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        total = running + self.counts[-1]
        return out + [f'{name}_bucket{{le="+Inf"}} {total}', f"{name}_sum {self.sum:.6f}", f"{name}_count {total}"]


class ServerMetrics:
    def __init__(self):
        self.snapshot: dict = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(TTFT_BUCKETS)
        self.by_reason: collections.Counter = collections.Counter()
        self.prompt_tokens = 0
        self.refused = 0  # 503 at admission
        self.aborted = 0  # client disconnected
        self._lock = threading.Lock()
        self._rate_samples: collections.deque = collections.deque()  # (monotonic time, output tokens)

    def finished(self, request) -> None:
        """Record a finished engine request (engine thread)."""
        m = request.metrics
        with self._lock:
            self.by_reason[request.finish_reason] += 1
            self.prompt_tokens += m.prompt_tokens
            if m.ttft_s is not None:
                self.ttft.observe(m.ttft_s)
            for gap in m.itl_s:
                self.itl.observe(gap)
            if m.e2e_s is not None:
                self.e2e.observe(m.e2e_s)

    def tokens_per_s(self, snapshot: dict) -> float:
        """Output tokens per second over the last RATE_WINDOW_S seconds (0 when idle)."""
        now, tokens = snapshot.get("at", time.monotonic()), snapshot.get("output_tokens", 0)
        with self._lock:
            samples = self._rate_samples
            if not samples or samples[-1][1] != tokens:
                samples.append((now, tokens))
            while len(samples) > 1 and samples[1][0] < now - RATE_WINDOW_S:
                samples.popleft()
            (t0, n0) = samples[0]
        return (tokens - n0) / (now - t0) if now > t0 else 0.0

    def render(self) -> str:
        s = self.snapshot
        rate = self.tokens_per_s(s)
        gauges = [
            ("lowbit_requests_running", "Requests in the running batch.", s.get("running", 0)),
            ("lowbit_requests_waiting", "Requests waiting for a cache slot or blocks.", s.get("waiting", 0)),
            ("lowbit_kv_cache_blocks_used", "KV cache pool blocks in use.", s.get("blocks_total", 0) - s.get("blocks_free", 0)),
            ("lowbit_kv_cache_blocks_free", "KV cache pool blocks free.", s.get("blocks_free", 0)),
            ("lowbit_generation_tokens_per_second", f"Output tokens per second over the last {RATE_WINDOW_S:g} s.", rate),
        ]
        counters = [
            ("lowbit_preemptions_total", "Requests preempted (cache recomputed later).", s.get("preemptions", 0)),
            ("lowbit_generation_tokens_total", "Output tokens generated.", s.get("output_tokens", 0)),
            ("lowbit_prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("lowbit_requests_refused_total", "Requests refused at admission (queue full).", self.refused),
            ("lowbit_requests_aborted_total", "Requests aborted because the client disconnected.", self.aborted),
        ]
        lines = []
        for name, help_, value in gauges + counters:
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
        with self._lock:
            lines += ["# HELP lowbit_requests_finished_total Requests finished, by reason.",
                      "# TYPE lowbit_requests_finished_total counter"]
            lines += [f'lowbit_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.by_reason.items())]
            for name, help_, hist in (("lowbit_time_to_first_token_seconds", "Arrival to first token.", self.ttft),
                                      ("lowbit_inter_token_latency_seconds", "Gap between output tokens.", self.itl),
                                      ("lowbit_request_latency_seconds", "Arrival to finish.", self.e2e)):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
        return "\n".join(lines) + "\n"


def _number(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(int(value))

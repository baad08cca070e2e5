"""Prometheus text exposition with vLLM's metric names and labels (`model_name`, `engine`).

A small hand-rolled registry instead of prometheus_client: the hot path observes a histogram many
times per request (inter-token latency), and `observe(value, count)` lets a zero-latency request
record all its tokens in one call. The output is standard text format 0.0.4 (the tests parse it with
prometheus_client's parser).
"""
from __future__ import annotations

from bisect import bisect_left

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return f"{float(v):.1f}"
    return repr(float(v))


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n


class Metrics:
    def __init__(self, model_name: str, engine: str = "0"):
        self.model_name = model_name
        self.engine = engine
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.success: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue = Histogram(REQUEST_BUCKETS)
        self.prefill = Histogram(REQUEST_BUCKETS)
        self.decode = Histogram(REQUEST_BUCKETS)
        self.req_prompt = Histogram(TOKEN_BUCKETS)
        self.req_gen = Histogram(TOKEN_BUCKETS)

    def render(self, *, running: int, waiting: int, waiting_capacity: int, kv_usage: float,
               sleeping: int, cache_info: dict[str, str]) -> str:
        lab = f'engine="{self.engine}",model_name="{_esc(self.model_name)}"'
        out: list[str] = []

        def head(name, kind, help_):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        def gauge(name, value, help_):
            head(name, "gauge", help_)
            out.append(f"{name}{{{lab}}} {_fmt(value)}")

        def counter(name, value, help_):
            head(name, "counter", help_)
            out.append(f"{name}_total{{{lab}}} {_fmt(value)}")

        def hist(name, h: Histogram, help_):
            head(name, "histogram", help_)
            acc = 0
            for b, c in zip(h.buckets, h.counts):
                acc += c
                out.append(f'{name}_bucket{{{lab},le="{_fmt(b)}"}} {_fmt(acc)}')
            out.append(f'{name}_bucket{{{lab},le="+Inf"}} {_fmt(h.count)}')
            out.append(f"{name}_count{{{lab}}} {_fmt(h.count)}")
            out.append(f"{name}_sum{{{lab}}} {_fmt(h.sum)}")

        gauge("vllm:num_requests_running", running, "Number of requests in model execution batches.")
        gauge("vllm:num_requests_waiting", waiting, "Number of requests waiting to be processed.")
        head("vllm:num_requests_waiting_by_reason", "gauge", "Number of requests waiting, by reason.")
        out.append(f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}} {_fmt(waiting_capacity)}')
        out.append(f'vllm:num_requests_waiting_by_reason{{{lab},reason="paused"}} {_fmt(waiting - waiting_capacity)}')
        gauge("vllm:kv_cache_usage_perc", kv_usage, "KV-cache usage. 1 means 100 percent usage.")
        gauge("vllm:gpu_cache_usage_perc", kv_usage, "GPU KV-cache usage (deprecated name). 1 means 100 percent usage.")
        gauge("vllm:engine_sleep_state", sleeping, "Engine sleep state; 0 awake, else the sleep level.")
        head("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.")
        info = ",".join(f'{k}="{_esc(str(v))}"' for k, v in sorted(cache_info.items()))
        out.append(f"vllm:cache_config_info{{{info},engine=\"{self.engine}\"}} 1.0")
        counter("vllm:prompt_tokens", self.prompt_tokens, "Number of prefill tokens processed.")
        counter("vllm:generation_tokens", self.generation_tokens, "Number of generation tokens processed.")
        counter("vllm:num_preemptions", self.preemptions, "Cumulative number of preemptions from the engine.")
        head("vllm:request_success", "counter", "Count of successfully processed requests.")
        for reason in sorted(set(self.success) | {"stop", "length", "abort"}):
            out.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} {_fmt(self.success.get(reason, 0))}')
        counter("vllm:prefix_cache_queries", self.prefix_queries, "Prefix cache queries, in terms of number of queried tokens.")
        counter("vllm:prefix_cache_hits", self.prefix_hits, "Prefix cache hits, in terms of number of cached tokens.")
        hist("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds.")
        hist("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds.")
        hist("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds.")
        hist("vllm:request_queue_time_seconds", self.queue, "Histogram of time spent in WAITING phase for request.")
        hist("vllm:request_prefill_time_seconds", self.prefill, "Histogram of time spent in PREFILL phase for request.")
        hist("vllm:request_decode_time_seconds", self.decode, "Histogram of time spent in DECODE phase for request.")
        hist("vllm:request_prompt_tokens", self.req_prompt, "Number of prefill tokens processed.")
        hist("vllm:request_generation_tokens", self.req_gen, "Number of generation tokens processed.")
        return "\n".join(out) + "\n"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

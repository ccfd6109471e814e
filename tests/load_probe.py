"""Build an engine on a model in a fresh process and print, as JSON, what loading cost:
wall time, resident memory before and at its peak (the peak reset after the imports, so
it counts the load only), the stages the progress hook heard, and the model's bf16 bytes.

    python tests/load_probe.py MODEL CACHE_DIR [DTYPE]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from paged_chat.engine import Engine, EngineConfig


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    model, cache_dir = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak RSS, to now
    baseline = _status_kib("VmRSS")
    stages: list[str] = []

    def on_progress(stage: str, done: int, total: int) -> None:
        if not stages or stages[-1] != stage:
            stages.append(stage)

    started = time.perf_counter()
    engine = Engine(EngineConfig(model=model, device="cpu", dtype=dtype, num_blocks=16,
                                 cache_dir=cache_dir), on_progress=on_progress)
    seconds = time.perf_counter() - started
    params = engine.info.num_parameters
    print(json.dumps({"seconds": seconds, "baseline_rss": baseline * 1024,
                      "peak_rss": _status_kib("VmHWM") * 1024, "stages": stages,
                      "bf16_bytes": 2 * params}))


if __name__ == "__main__":
    main()

"""The device check's engine stages (benchmarks/engine_checks.py) at their GPU sizes: every
check of each passes."""

import pytest

from benchmarks import engine_checks

STAGES = {
    "transformers": lambda: engine_checks.transformers_stage(engine_checks.GPU_ENGINE_PLAN),
    "graphs": lambda: engine_checks.graphs_stage(engine_checks.GPU_ENGINE_PLAN),
    "default_config": lambda: engine_checks.default_config_stage(engine_checks.GPU_ENGINE_PLAN),
    "sampling": lambda: engine_checks.sampling_stage(engine_checks.GPU_ENGINE_PLAN),
    "throughput": lambda: engine_checks.throughput_stage(engine_checks.GPU_ENGINE_PLAN, None),
    "peer": lambda: engine_checks.peer_stage(engine_checks.GPU_ENGINE_PLAN),
}


# The throughput stage's checks are the tokens/s figures: wall-clock bounds.
@pytest.mark.parametrize("stage", [pytest.param(name, marks=pytest.mark.perf)
                                   if name == "throughput" else name for name in STAGES])
def test_engine_stage_passes_on_the_gpu(stage):
    checks = STAGES[stage]()["checks"]
    assert checks, "a stage that makes no check proves nothing"
    assert [c for c in checks if not c["ok"]] == []

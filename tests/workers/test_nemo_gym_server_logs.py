"""Where ng_run's profiling servers write `<name>.log` (nemo_gym.server_utils.setup_profiling: WORKING_DIR /
profiling_results_dirpath / "<Class>___<name>"), as workers.profiling.nemo_gym finds it."""
from __future__ import annotations

from workers.nemo_gym.deployment import Server
from workers.profiling.nemo_gym import server_log, server_log_dirs

RES = Server(name="math_res", kind="resources", url="http://127.0.0.1:1", impl="math_with_judge")


def test_relative_dirpath_is_under_each_servers_own_directory(tmp_path):
    cfg = tmp_path / "site" / "resources_servers" / "math_with_judge" / "configs" / "math_with_judge.yaml"
    log = tmp_path / "site" / "resources_servers" / "math_with_judge" / "results" / "p" / \
        "MathWithJudgeResourcesServer___math_res" / "math_res.log"
    log.parent.mkdir(parents=True)
    log.write_text("x")
    profiling = {"dirpath": "results/p", "config_paths": [str(cfg)]}
    assert server_log_dirs(RES, profiling) == [str(log.parent.parent)]
    assert server_log(RES, profiling) == str(log)
    # another server's folder is not this server's
    other = Server(name="other", kind="resources", url="http://127.0.0.1:2", impl="math_with_judge")
    assert server_log(other, profiling) is None


def test_absolute_dirpath_and_nothing_configured(tmp_path):
    log = tmp_path / "prof" / "X___math_res" / "math_res.log"
    log.parent.mkdir(parents=True)
    log.write_text("x")
    assert server_log(RES, {"dirpath": str(tmp_path / "prof"), "config_paths": []}) == str(log)
    assert server_log(RES, {"dirpath": None}) is None
    assert server_log(RES, {"dirpath": "rel", "config_paths": ["relative/configs/a.yaml"]}) is None

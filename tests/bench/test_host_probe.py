"""The host description every benchmark report carries: CPU model, cores and the
backward hand-off a one-op torch backward measures."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gemmconv.bench import models as bench_models
from gemmconv.bench import public_calls as bench_api
from gemmconv.bench.host_probe import backward_handoff_us, cpu_model, host_fields, host_lines
from gemmconv.bench.suite import main


def test_cpu_model_names_something():
    assert cpu_model().strip()


def test_backward_handoff_times_both_threads_on_the_cpu():
    times = backward_handoff_us(torch.device("cpu"), calls=30)
    assert set(times) == {"device_thread", "calling_thread"}
    for name, us in times.items():
        assert math.isfinite(us) and 0 < us < 1e6, (name, us)


def test_backward_handoff_leaves_the_threading_setting_as_it_was():
    torch.autograd.set_multithreading_enabled(True)
    backward_handoff_us(torch.device("cpu"), calls=5)
    assert torch._C._is_multithreading_enabled()


def test_backward_handoff_times_under_no_grad_too():
    with torch.no_grad():
        times = backward_handoff_us(torch.device("cpu"), calls=5)
    assert times["calling_thread"] > 0


def test_backward_handoff_refuses_no_calls():
    with pytest.raises(ValueError, match="calls=0"):
        backward_handoff_us(torch.device("cpu"), calls=0)


def test_host_lines_say_each_figure_where_it_applies():
    fields = {"host_cpu": "Some CPU", "host_cores": 16,
              "backward_handoff_us": {"device_thread": 84.5, "calling_thread": 52.9}}  # fmt: skip
    (gpu_text, blank) = host_lines({"device": "NVIDIA H100 80GB HBM3", **fields})
    assert blank == ""
    assert "Some CPU, 16 cores" in gpu_text
    assert "84.5 us" in gpu_text and "52.9 us" in gpu_text and "device thread" in gpu_text
    (cpu_text, _) = host_lines({"device": "cpu", **fields})
    assert "52.9 us" in cpu_text and "device thread" not in cpu_text
    # Results recorded before the host was described render without the paragraph.
    assert host_lines({"device": "cpu"}) == []


def test_host_fields_are_json_ready():
    fields = host_fields(torch.device("cpu"), quick=True)
    assert json.loads(json.dumps(fields)) == fields
    assert fields["host_cores"] >= 1


def _first_paragraph_after_versions(text: str) -> str:
    return text.split("\n\n")[2]


def test_every_report_describes_its_host(tmp_path):
    suite = tmp_path / "suite"
    assert main(["--device", "cpu", "--quick", "--cases", "resnet_1x1", "--layouts", "cl",
                 "--directions", "fwd", "--warmup", "0", "--reps", "1", "--out", str(suite),
                 "--name", "cpu"]) == 0  # fmt: skip
    api = tmp_path / "api"
    assert bench_api.main(["--api", "--device", "cpu", "--quick", "--cases", "point2d_950",
                           "--kinds", "fwd", "--reps", "1", "--out", str(api)]) == 0  # fmt: skip
    for folder, stem in ((suite, "cpu"), (api, "cpu")):
        data = json.loads((folder / f"{stem}.json").read_text())
        assert data["host_cpu"] == cpu_model()
        assert set(data["backward_handoff_us"]) == {"device_thread", "calling_thread"}
        text = (folder / f"{stem}.md").read_text()
        assert _first_paragraph_after_versions(text).startswith("Host: "), stem


def test_the_end_to_end_results_describe_their_host():
    results = bench_models._empty_results(torch.device("cpu"), quick=True, steps=1, warmup=1)
    assert results["host_cpu"] == cpu_model()
    assert results["backward_handoff_us"]["calling_thread"] > 0

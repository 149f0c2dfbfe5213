"""dash-bench's record of the SM clock during each timing (dash_plugin/bench/clocks.py), on the
CPU: parsing nvidia-smi's lines, what a window of samples says, the monitor fed by a stand-in
for nvidia-smi, the cells' record and the report's section."""
import sys
import time

import torch

from dash_plugin.bench import clocks, report, runner

from tests.test_bench import _FAST, _SMALL, _fake_impl, _synthetic_results


def test_parse_sample_reads_clock_and_throttle_bits_and_skips_other_lines():
    assert clocks.parse_sample("1635, 0x0000000000000004\n") == (1635, 4)
    assert clocks.parse_sample("1980, 0x0000000000000000") == (1980, 0)
    assert clocks.parse_sample("[N/A], [N/A]") is None
    assert clocks.parse_sample("Failed to initialize NVML") is None


def test_a_window_gives_the_lowest_and_median_clock_and_the_power_cap():
    samples = [(0.0, 1980, 0), (1.0, 1755, 4), (1.1, 1335, 4), (1.2, 1620, 4), (3.0, 1650, 4)]
    w = clocks.summarize(samples, 0.9, 1.25)
    assert w == {"sm_mhz_min": 1335, "sm_mhz_median": 1620, "samples": 3, "power_capped": True,
                 "hw_slowdown": False}
    assert clocks.summarize(samples, -1, 0.5)["power_capped"] is False
    assert clocks.summarize(samples, 1.5, 2.5) is None   # nothing sampled there


_FAKE_SMI = ("import sys, time\n"
             "for line in ['1980, 0x0', '[N/A], [N/A]', '1335, 0x4', '1620, 0x4']:\n"
             "    print(line, flush=True)\n"
             "    time.sleep(0.05)\n"
             "time.sleep(30)\n")


def test_the_monitor_samples_a_command_until_closed():
    t0 = time.monotonic()
    with clocks.ClockMonitor(torch.device("cuda"), command=[sys.executable, "-c", _FAKE_SMI]) as monitor:
        deadline = time.monotonic() + 20
        while len(monitor.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert monitor.reason is None and monitor._proc.poll() is not None   # stopped when closed
    assert [(mhz, bits) for _, mhz, bits in monitor.samples] == [(1980, 0), (1335, 4), (1620, 4)]
    w = monitor.window(t0, time.monotonic())
    assert w["sm_mhz_min"] == 1335 and w["samples"] == 3 and w["power_capped"] is True
    assert monitor.describe() == {"interval_ms": 50, "samples": 3, "reason": None}


def test_the_monitor_samples_other_fields_with_its_own_parser(monkeypatch):
    """The query and the parser are the caller's (scripts/gpu_sustained_orders.py reads the power)."""
    monkeypatch.setattr(clocks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(clocks, "_gpu_selector", lambda device: "00000000:01:00.0")
    monitor = clocks.ClockMonitor(torch.device("cuda"), query="clocks.sm,power.draw", parse=lambda line: (line,))
    assert "--query-gpu=clocks.sm,power.draw" in monitor._default_command()
    power = ("import time\nprint('1500, 650.5', flush=True)\ntime.sleep(30)\n")
    with clocks.ClockMonitor(torch.device("cuda"), command=[sys.executable, "-c", power],
                             parse=lambda line: tuple(float(x) for x in line.split(","))) as monitor:
        deadline = time.monotonic() + 20
        while not monitor.samples and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [sample[1:] for sample in monitor.samples] == [(1500.0, 650.5)]


def _monitor_a_sampler_that_quits():
    """A monitor closed after its sampler printed one sample and exited with status 3."""
    quits = "print('1650, 0x4', flush=True)\nraise SystemExit(3)\n"
    with clocks.ClockMonitor(torch.device("cuda"), command=[sys.executable, "-c", quits]) as monitor:
        deadline = time.monotonic() + 20
        while monitor._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    return monitor


def test_a_sampler_that_stops_early_or_gives_nothing_is_reported():
    monitor = _monitor_a_sampler_that_quits()
    assert monitor.reason.endswith("exited (status 3) after 1 samples")
    silent = "import time\ntime.sleep(30)\n"
    with clocks.ClockMonitor(torch.device("cuda"), command=[sys.executable, "-c", silent]) as monitor:
        pass
    assert monitor.reason.endswith("gave no clock samples") and monitor._proc.poll() is not None


def test_a_sampler_that_stopped_is_counted_after_its_reader_finished(monkeypatch):
    """The count in the reason waits for the reader thread: a reader scheduled late (a loaded
    machine) still has the sampler's last line to parse when the sampler has already exited."""
    parse = clocks.parse_sample

    def late(line):
        time.sleep(0.2)
        return parse(line)

    monkeypatch.setattr(clocks, "parse_sample", late)
    monitor = _monitor_a_sampler_that_quits()
    assert monitor.reason.endswith("exited (status 3) after 1 samples")
    assert [(mhz, bits) for _, mhz, bits in monitor.samples] == [(1650, 4)]


def test_the_monitor_says_why_it_records_nothing():
    with clocks.ClockMonitor(torch.device("cpu")) as monitor:
        pass
    assert monitor.reason == "not a CUDA device" and monitor.samples == []
    with clocks.ClockMonitor(torch.device("cuda"), command=["/nonexistent/nvidia-smi"]) as monitor:
        pass
    assert monitor.reason.startswith("could not start /nonexistent/nvidia-smi")


def test_without_nvidia_smi_on_the_path_the_monitor_says_so(monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    with clocks.ClockMonitor(torch.device("cuda")) as monitor:
        pass
    assert monitor.reason == "nvidia-smi not found" and monitor.samples == []


class _RecordingClocks:
    def __init__(self):
        self.asked = []

    def window(self, t0, t1):
        self.asked.append((t0, t1))
        return {"sm_mhz_min": 1500 + len(self.asked), "sm_mhz_median": 1600, "samples": 2,
                "power_capped": True, "hw_slowdown": False}


def test_a_cell_records_the_clock_of_each_of_its_three_timings():
    monitor = _RecordingClocks()
    inputs = runner.make_inputs(_SMALL, torch.device("cpu"), seed=1)
    cell, _ = runner.run_cell(_fake_impl("plain"), _SMALL, inputs, torch.device("cpu"), _FAST, None, monitor)
    assert list(cell["sm_clock"]) == ["fwd_first", "bwd", "fwd_again"]
    assert [w["sm_mhz_min"] for w in cell["sm_clock"].values()] == [1501, 1502, 1503]
    # consecutive windows, in time order
    (a0, a1), (b0, b1), (c0, c1) = monitor.asked
    assert a0 <= a1 == b0 <= b1 == c0 <= c1
    assert "bwd at 1600 MHz (min 1502)" in runner._fmt_cell(cell)


def test_the_report_names_the_timings_made_in_a_clock_dip():
    results = _synthetic_results()
    steady = {"sm_mhz_min": 1620, "sm_mhz_median": 1635, "samples": 3, "power_capped": True, "hw_slowdown": False}
    for cell in results["cells"]:
        if cell["status"] == "ok":
            cell["sm_clock"] = {"fwd_first": steady, "bwd": steady, "fwd_again": steady}
    dipped = next(c for c in results["cells"] if c["impl"] == "dash-shift")
    dipped["sm_clock"] = dict(dipped["sm_clock"], bwd=dict(steady, sm_mhz_min=1335))
    # another point ran at the idle clock throughout: compared within itself, no dip
    idle = {"sm_mhz_min": 1980, "sm_mhz_median": 1980, "samples": 3, "power_capped": False, "hw_slowdown": False}
    for cell in results["cells"]:
        if cell["status"] == "ok" and cell["point"] != dipped["point"]:
            cell["sm_clock"] = {"fwd_first": idle, "bwd": idle, "fwd_again": idle}
    medians, dips = report.clock_dips(results)
    assert medians[dipped["point"]] == 1635 and set(medians.values()) == {1635, 1980}
    assert dips == [(dipped["point"], "dash-shift", "bwd", 1335)]
    text = report.render_markdown(results)
    assert "## SM clock during the timings" in text and "- dash-shift at" in text and "down to 1335 MHz" in text
    assert "below 90 % of its point's median" in text
    # windows without samples are left out; without the dip nothing is named
    dipped["sm_clock"] = dict(dipped["sm_clock"], bwd=steady, fwd_first=None)
    medians, dips = report.clock_dips(results)
    assert dips == [] and medians[dipped["point"]] == 1635
    assert "No timing saw the clock below 90 % of its point's median." in report.render_markdown(results)


def test_the_report_says_when_the_clock_was_not_recorded_on_a_gpu():
    results = _synthetic_results()
    results["clock_monitor"] = {"interval_ms": 50, "samples": 0, "reason": "nvidia-smi not found"}
    assert "SM clock not recorded: nvidia-smi not found." in report.render_markdown(results)
    results["clock_monitor"] = {"interval_ms": 50, "samples": 12, "reason": None}   # sampled, no cell timed
    assert "SM clock not recorded: no timing had a clock sample." in report.render_markdown(results)
    results["clock_monitor"] = {"interval_ms": 50, "samples": 0, "reason": "not a CUDA device"}
    assert "SM clock" not in report.render_markdown(results)

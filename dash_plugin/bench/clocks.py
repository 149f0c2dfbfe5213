"""The GPU's SM clock while cells are timed.

A Hopper board at its power cap lowers the SM clock, and as the power ramps up after an idle
spell (a compile, a bitwise check on the host) the clock dips for a few hundred milliseconds
before it settles. Measured on an H100 (700 W): 1,980 MHz idle, about 1,635 MHz at the cap, dips
to 1,320-1,410 MHz; a kernel timed in a dip read 10-15 % fewer TFLOP/s than the rounds beside it.
So a time means little without the clock it ran at: `ClockMonitor` samples the clock and the
throttle reasons with `nvidia-smi` in a background thread, and `window` says what the GPU did
between two instants (dash-bench records it per cell).

Without `nvidia-smi` (or on the CPU) the monitor records nothing and says why.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from typing import Optional

QUERY = "clocks.sm,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4   # nvidia-smi's clocks_throttle_reasons bit for the software power cap
HW_SLOWDOWN = 0x8 | 0x40 | 0x80   # hardware, hardware thermal and power-brake slowdowns


def parse_sample(line: str) -> Optional[tuple[int, int]]:
    """(SM MHz, throttle-reason bits) of one `--format=csv,noheader,nounits` line, or None for
    a line that does not hold them ("[N/A]", a warning)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        return int(parts[0]), int(parts[1], 16)
    except ValueError:
        return None


def summarize(samples: list[tuple[float, int, int]], t0: float, t1: float) -> Optional[dict]:
    """What the samples (monotonic time, MHz, bits) between t0 and t1 show, or None if none fell
    there: the lowest and the median SM clock, and whether the power cap or a hardware slowdown
    was active in any of them."""
    inside = [(mhz, bits) for t, mhz, bits in samples if t0 <= t <= t1]
    if not inside:
        return None
    mhz = [m for m, _ in inside]
    return {"sm_mhz_min": min(mhz), "sm_mhz_median": statistics.median(mhz), "samples": len(inside),
            "power_capped": any(b & SW_POWER_CAP for _, b in inside),
            "hw_slowdown": any(b & HW_SLOWDOWN for _, b in inside)}


def _gpu_selector(device) -> Optional[str]:
    """nvidia-smi's -i argument for a torch CUDA device: its PCI address, which does not depend on
    CUDA_VISIBLE_DEVICES; None where torch does not report it."""
    import torch
    try:
        props = torch.cuda.get_device_properties(device)
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except (AttributeError, RuntimeError):
        return None


NOT_CUDA = "not a CUDA device"   # the reason a monitor of another device gives (the report reads it)


class ClockMonitor:
    """Samples the SM clock of `device` every `interval_ms` while open (a context manager).
    `reason` is None while it records, else why it does not (or stopped early). `query` and
    `parse` (a line to a tuple of values, or None) sample other fields (a script reads the power);
    `window` reads only the default ones."""

    def __init__(self, device, interval_ms: int = 50, command: Optional[list] = None, query: str = QUERY,
                 parse=parse_sample):
        self.samples: list[tuple] = []   # (monotonic time, *parse(line))
        self._query, self._parse = query, parse
        self.reason: Optional[str] = None
        self._command = command
        self._interval_ms = interval_ms
        self._device = device
        self._proc = None
        self._thread = None

    def __enter__(self) -> "ClockMonitor":
        self._command = self._command or self._default_command()
        command = self._command
        if command is None:
            return self
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as exc:
            self.reason = f"could not start {command[0]}: {exc}"
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _default_command(self) -> Optional[list]:
        if getattr(self._device, "type", "cpu") != "cuda":
            self.reason = NOT_CUDA
            return None
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.reason = "nvidia-smi not found"
            return None
        selector = _gpu_selector(self._device)
        if selector is None:
            self.reason = "torch does not report the GPU's PCI address"
            return None
        return [smi, "-i", selector, f"--query-gpu={self._query}", "--format=csv,noheader,nounits",
                "-lms", str(self._interval_ms)]

    def _read(self):
        for line in self._proc.stdout:
            sample = self._parse(line)
            if sample is not None:
                self.samples.append((time.monotonic(), *sample))

    def __exit__(self, *exc):
        if self._proc is not None:
            status = self._proc.poll()
            if status is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            # The reader may still be parsing the last lines: join it before counting its samples.
            self._thread.join(timeout=5)
            self._proc.stdout.close()
            if status is not None:   # it stopped by itself: timings after that have no clock
                self.reason = f"{self._name()} exited (status {status}) after {len(self.samples)} samples"
            if not self.samples and self.reason is None:
                self.reason = f"{self._name()} gave no clock samples"
        return False

    def _name(self) -> str:   # only asked once the sampler ran, so with a command
        return os.path.basename(self._command[0])

    @property
    def recording(self) -> Optional["ClockMonitor"]:
        """This monitor while it records, else None: what a timing loop takes as its `clocks`."""
        return self if self.reason is None else None

    def describe(self) -> dict:
        """For a results file: how the clock was sampled, how often it was, and why not if not."""
        return {"interval_ms": self._interval_ms, "samples": len(self.samples), "reason": self.reason}

    def window(self, t0: float, t1: float) -> Optional[dict]:
        """The clock between two `time.monotonic()` instants (see `summarize`); None if nothing
        was sampled there."""
        # The reader thread appends; a copy of the list is a consistent snapshot.
        return summarize(list(self.samples), t0, t1)


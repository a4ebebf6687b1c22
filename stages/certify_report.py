"""What certify reports: its checks, pass, fail or diagnostic, and their table."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Check:
    name: str
    passed: bool | None    # None: a diagnostic
    detail: str
    max_abs_diff: float | None = None  # logits compared: the largest |difference|


@dataclass
class Report:
    model: str
    stages: int
    runtime: str               # its name
    weight_format: str | None  # None: a runtime computing with the file's own weights
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def as_dict(self) -> dict:
        return {"model": self.model, "stages": self.stages, "runtime": self.runtime,
                "weight_format": self.weight_format, "passed": self.passed,
                "checks": [c.__dict__ for c in self.checks]}

    def table(self) -> str:
        weights = f"{self.weight_format} weights" if self.weight_format else "the file's weights"
        lines = [f"certify {self.model}: {self.stages} stage(s), {self.runtime} runtime, "
                 f"{weights}"]
        for c in self.checks:
            status = "diag" if c.passed is None else ("PASS" if c.passed else "FAIL")
            lines.append(f"  {status:<4}  {c.name:<26} {c.detail}")
        lines.append("result: " + ("PASS" if self.passed else "FAIL"))
        return "\n".join(lines)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())

"""What a verl config's translation reports: every setting rlmega refuses, and every one it takes differently,
each as a row (verl key, verl value, what rlmega does instead, why), shown together as one table."""

from __future__ import annotations

import dataclasses

from rlmega.config.verl_setting import VerlTranslationError

REFUSED = "refused"
NOT_USED = "not used"


@dataclasses.dataclass(frozen=True)
class ReportRow:
    key: str
    """The verl key."""
    value: str
    """Its value in the config, in Hydra's spelling."""
    rlmega: str
    """What rlmega does instead: ``refused``, ``not used``, or the rlmega settings it becomes."""
    why: str

    def line(self) -> str:
        return f"verl {self.key}={self.value}: {self.why}"


@dataclasses.dataclass
class VerlTranslation:
    """A verl config's rlmega overrides, the settings rlmega takes differently, and the ones it refuses."""

    overrides: list[str]
    changed: list[ReportRow]
    refused: list[ReportRow]

    def check(self) -> list[str]:
        """The overrides; VerlTranslationError naming every refused setting when there is one."""
        if self.refused:
            raise RefusedSettings(self.refused)
        return self.overrides


class RefusedSettings(VerlTranslationError):
    """The settings of a verl config that cannot cross over, all of them: one line for one, else a line naming
    each (``table()`` shows them with their reasons)."""

    def __init__(self, rows: list[ReportRow]):
        self.rows = list(rows)
        if len(rows) == 1:
            message = rows[0].line()
        else:
            message = (f"{len(rows)} verl settings cannot cross over to rlmega: "
                       + "; ".join(f"{row.key}={row.value} ({row.why})" for row in rows))
        super().__init__(message)

    def table(self) -> str:
        return report_table(self.rows)


COLUMNS = ("verl key", "value", "rlmega", "why")


def report_table(rows: list[ReportRow]) -> str:
    """``rows`` as a Markdown table (key, value, what rlmega does instead, why), one row a line."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [f"| `{cell(row.key)}` | `{cell(row.value)}` | {cell(row.rlmega)} | {cell(row.why)} |" for row in rows]
    return "\n".join(lines)

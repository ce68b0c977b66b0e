# The rules of every public convention (compiled from _rules.pyx).
from collections.abc import Mapping

ROLES: dict[str, int]
OUT_INDEX: dict[str, int]

class Convention:
    def __init__(
        self,
        names: Mapping[str, str],
        *,
        family: str = "arrays",
        dtype_rule: str = "graph",
        ranks: tuple[int, int] = (2, 8),
        data_format: bool = True,
        scale_required: bool = False,
        beta_required: bool = False,
    ) -> None: ...
    def name(self, role: str) -> str: ...

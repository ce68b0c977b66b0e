# The named schedules (compiled from _schedules.pyx).
SCHEDULE_NAMES: dict[int, str]
TILE_ELEMENTS: int

def cache_model() -> tuple[int, int, int]: ...
def set_cache_model(l2: int, l3: int, sharers: int) -> None: ...

STREAM_POLICIES: dict[str, int]

def set_stream_policy(policy: str) -> str: ...

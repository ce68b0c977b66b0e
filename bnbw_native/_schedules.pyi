# The named schedules (compiled from _schedules.pyx).
SCHEDULE_NAMES: dict[int, str]
TILE_ELEMENTS: int

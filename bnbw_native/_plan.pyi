# Plans: canonical dims, rows and the fixed partition of the sums (compiled from _plan.pyx).
BLOCK_ELEMENTS: int

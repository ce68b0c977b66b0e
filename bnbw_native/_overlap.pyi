# Whether memory is shared, decided exactly (compiled from _overlap.pyx); no Python names.

def _placeholder():
    pass

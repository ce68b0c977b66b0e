# placeholder: the DirectML operators and the C API table
def _placeholder():
    pass

"""``mstar-store``: the command line, a thin layer over the library (see ``main``)."""

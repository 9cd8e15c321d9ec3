"""The ``mineru-fast`` command line (``main``): its shared flags (``options``), ``info``, ``launch``
(pinned ``parse`` workers) and ``serve`` (the service's flags and start-up)."""

"""Runtime facts, below everything that computes: the CPU (``cpu``: topology, NUMA, ISA class and
simulated lower classes), the thread policy (``threads``), the ISA-aware choices made from recorded
measurements (``choice``), pinned worker processes (``launch``), and where models and cached files
come from (``hub``). Nothing here imports torch or any other layer of the package."""

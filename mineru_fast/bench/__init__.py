"""The latency benchmark (``mineru-fast bench``): stage table, concurrency, roofline."""

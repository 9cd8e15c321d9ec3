"""MinerU2.5's protocol, as data and pure functions (no torch): the chat format, special tokens,
prompts, sampling tables and model versions (``spec``); one page's two steps, from the layout
output to the content requests (``page``); and replay traces, the exact outputs a parse must
produce, of the VLM (``traces``) and of PP-DocLayoutV2 (``layout_trace``)."""

"""The pipeline: ``DocumentParser`` (``parser``) drives a document through inputs, layout, the
protocol and the engine into results, page by page; ``standard`` is the ``standard`` tier's page
plan (PDF text where it can be trusted, the VLM for the rest)."""

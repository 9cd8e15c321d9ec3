"""Results: a page's blocks built from the engine's outputs by MinerU's post-processing
(``finish``), the ``Page`` / ``Block`` model (``page``) and the ``Document`` (``document``), MinerU
4's page model and middle JSON (``mineru4``, ``middle``, ``table_merge``), the writers of MinerU 4's
bundle and MinerU 2.x's layout (``writer``, ``formats``, ``official``: DocVortex's renderers where
installed), and the metadata block of a result (``metadata``). Nothing here knows who produced
the pages: the pipeline and the doors import results, never the other way round."""

"""kvtier's commands (``kvtier ...``; ``main``): ``demo``, ``bench``, ``serve`` (a local pool,
``servers``), ``proxy`` (prefill/decode), ``doctor``, ``config`` and ``vllm-api``. None of
them runs inside an engine; the product does not import them."""

"""The command-line layer: flags, launching ranks, and what people read.

``args``: the flags every training CLI shares and the config they build. ``launch``: how ranks start
(local processes, one rank per shell, torchrun) and the checks made before any starts. ``output``:
logging set-up, the one-line bad-input error, the final summary. One module per command
(``pretrain``, ``finetune``, ``compare``, ``profile``, ``plan``); the top-level scripts only call
their ``main``. Library code below this package logs and never prints.
"""

"""The command-line layer: flags, the one run path, launching ranks, and what people read.

``args``: the flag groups, the config they build (a checkpoint's own model section included) and the typed
options the ranks get. ``run``: the path every command takes (parse, config, the checks made before any rank
starts, the plan resolved once, launch, the rank's body). ``launch``: how ranks start (local processes, one
rank per shell, torchrun, emulated clusters). ``output``: logging set-up, stage lines, the one-line bad-input
error, the final summary. One module per command (``pretrain``, ``finetune``, ``compare``, ``profile``,
``plan``, ``infer``) and ``main`` (``galaxy <command>``); the top-level scripts are shims of their ``main``.
Library code below this package logs and never prints.
"""

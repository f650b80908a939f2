"""What ``examples.dpo`` and ``examples.grpo`` share: a LoRA (or QLoRA) policy on a Hugging Face
base, trained in a run directory that resumes exactly, on one device or over a mesh.
``examples.finetune`` shares its flags, their checks, ``held``, ``join_processes`` and
``adapter_record``.

- ``config``: the flags every adapter program takes (run, base, model, optimizer), and
  ``PolicyConfig``, the frozen run configuration each program's own extends.
- ``held``: how the base is held (quantized or not, its dtypes) and the adapters put on it.
- ``jsonl``: reading a JSONL file, each bad line named ``file:line``.
- ``session``: the run itself, in the order a program calls it: ``Session.open`` (processes,
  run directory, the resumed run's flags, mesh, tokenizer), ``Session.load`` (the base with
  adapters, optimizer, the jitted steps of the program's loss, checkpoints, the restored
  state, config.json), then per update ``update``, ``evaluate`` and ``end_update``
  (checkpoints, interruptions), and ``finish`` (the peft adapter); ``join_processes`` and
  ``adapter_record`` (a checkpoint's contents) serve the fine-tuner too.

The programs keep only what is theirs: their data and their loop.
"""

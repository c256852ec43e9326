"""tutorial_lib: a small, complete re-implementation of Megatron-style 4D parallelism.

Read it module by module, like the book's chapters:

* :mod:`tutorial_lib.config`: parallel/model/train configs and the validator;
* :mod:`tutorial_lib.grid`: ranks <-> coordinates and every communicator group (pure);
* :mod:`tutorial_lib.launch`: run a function on N gloo/NCCL ranks from a notebook cell;
* :mod:`tutorial_lib.trace`, :mod:`tutorial_lib.comm`: traced collectives;
* :mod:`tutorial_lib.parallel_state`: the live process groups;
* :mod:`tutorial_lib.ring_collectives`: ring algorithms step by step;
* :mod:`tutorial_lib.tensor_parallel` (a package: mappings, layers, cross_entropy, random),
  :mod:`tutorial_lib.transformer`: TP layers and a block;
* :mod:`tutorial_lib.saved_activations`: what autograd keeps for backward, measured;
* :mod:`tutorial_lib.data_parallel`: gradient sync, buckets, clipping, ZeRO-1;
* :mod:`tutorial_lib.moe`, :mod:`tutorial_lib.moe_balance`: DeepSeekMoE with expert parallelism;
* :mod:`tutorial_lib.data`: the synthetic batches and how a global batch is cut;
* :mod:`tutorial_lib.gpt`, :mod:`tutorial_lib.tp_dp_step`: chapter 3's GPT and its TP + DP step;
* :mod:`tutorial_lib.deepseek`: the DeepSeek-style model a pipeline cuts into stages;
* :mod:`tutorial_lib.p2p`: the pipeline's point-to-point helpers;
* :mod:`tutorial_lib.pipeline_parallel`: pipeline schedules as pure data, their simulator and
  formulas, and the executor that runs a schedule with real stages;
* :mod:`tutorial_lib.arguments`, :mod:`tutorial_lib.train_4d`: the 4D run's arguments and
  their validation (no torch), and the run itself (``examples/train_4d.py``);
* :mod:`tutorial_lib.fp8`, :mod:`tutorial_lib.recipes`, :mod:`tutorial_lib.precision`: FP8
  tiles, precision recipes as data (no torch), and applying them to a model;
* :mod:`tutorial_lib.costs`: closed-form predictions (bytes, alpha-beta times);
* :mod:`tutorial_lib.timing`: the timing runs on this machine (the chapters' measurements);
* :mod:`tutorial_lib.viz`: widgets drawn from recorded traces.
"""
__version__ = "0.1.0"

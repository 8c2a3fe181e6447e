"""`mmoe-plan`: the fastest layout and switches for a model on a cluster, predicted before launching.

`cluster` describes the machines (nominal or a measured profile), `predict` enumerates the
candidates the trainer accepts and predicts each one's step time and memory by calling the
models the optimizations use themselves (Parm's cost model, Lancet's dW scheduling, Pro-Prophet's
performance model), `profile` measures a machine, `papers` checks the models at the papers' scale.
"""

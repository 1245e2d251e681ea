"""Who computes what, between the collectives (:mod:`dist_optim.comm`) and the optimizers.

* :mod:`.partition`: the equal partitions of a tensor's state over the ranks that share it;
* :mod:`.placement`, :mod:`.owners`: which rank owns a tensor's whole-tensor work, and how pieces
  reach it and results come back;
* :mod:`.runtime`: the owner runtime every optimizer with whole-tensor work steps through;
* :mod:`.budget`: the step-memory budget (``bucket_bytes``) that cuts a step into buckets.

How a parameter is cut is :mod:`dist_optim.layout`, below this layer. Nothing here does an
optimizer's math; every collective is issued through :mod:`dist_optim.comm`."""

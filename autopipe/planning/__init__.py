"""Planning: from a model to a :class:`~autopipe.planning.plan.Plan`, in the order the data flows.

1. :mod:`.trace` exports the model (torch.export) and finds the candidate split points.
2. :mod:`.profile` measures each segment between split points: time, memory, the tensors
   crossing each cut (:mod:`.scaling` fits those costs across micro-batch sizes with
   :mod:`.affine_fit`, :mod:`.rank_profile` measures each stage on its own rank).
3. :mod:`.costgraph` turns the segments into a networkx graph of costs.
4. :mod:`.partitioner` finds the split points that minimise the bottleneck stage,
   :mod:`.simulator` simulates one of the :mod:`.schedules` on those costs (a
   :mod:`.timeline` per step), :mod:`.baselines` computes the splits other tools would pick.
5. :mod:`.planner` ties it together (:func:`~autopipe.planning.planner.partition`) and
   returns a :mod:`.plan` (saved and loaded through :mod:`.plan_file`).
"""

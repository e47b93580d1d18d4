"""The front ends: the ``autopipe`` command line (:mod:`.main`), the demo it runs
(:mod:`.demo`) and the model specs it accepts (:mod:`.modelspec`)."""

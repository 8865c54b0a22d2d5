"""`brigade doctor` (`python -m train doctor`): a run's checklist before it runs, with the run's
own flags: the environment, the cluster, the layout and the inputs, each OK / WARN / FAIL with
one line of fix (plan/doctor/main.py)."""

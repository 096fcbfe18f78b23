"""Running a recipe's stages as one job that survives signals, divergence, damaged files and a
second run on the same directory (docs/reliability.md). ``hedgecats.cli`` parses the command line
and delegates here.

    spec       the pipeline YAML: shape, ``--set`` overrides, ``${...}`` references
    validate   every stage's full config against the classes' signatures, and the evaluate section
    rundir     the run directory: its marker, its lock, what each stage's ``done`` vouches for
    runner     each stage's config, its plan (new, resume, done, refused) and its run
    checkpoints  the periodic ``last.ckpt`` of a stage, one state key whatever its period
    errors     what a run stops on, with exit statuses
"""

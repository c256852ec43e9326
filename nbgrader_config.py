"""nbgrader's settings for this course (copied into a course folder by
``scripts/nbgrader_metadata.py``; see book/teaching.md).

The source notebooks come from the chapters: ``python scripts/nbgrader_metadata.py --course
DIR`` writes ``DIR/source/ch01/01_communicator_groups.ipynb`` and so on, with every exercise's
answer cell, test cell and locked cell marked.  Then, in DIR:

    nbgrader generate_assignment ch01     # release/ch01: the student edition
    nbgrader autograde ch01               # submitted/<student>/ch01 -> autograded/, points
"""
c = get_config()  # noqa: F821 - nbgrader's config loader provides it

c.CourseDirectory.root = "."

# The answer cell keeps the chapter's stub (def f(...): ... raise NotImplementedError) above
# the solution region; what replaces the region is only a pointer to it.
c.ClearSolutions.code_stub = {"python": "# (write your code in the function above)"}

# Each chapter runs in about a minute on 2 cores; a submission gets five before it is stopped.
c.ExecutePreprocessor.timeout = 300
c.Execute.timeout = 300

# A check cell that does not pass raises (tutorial_lib.exercises.kit.ExerciseNotPassed) under
# nbgrader, so the cell fails and scores nothing; its message is the verdict and the hints.

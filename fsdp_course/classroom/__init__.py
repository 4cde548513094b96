"""The classroom (floor 4): what students and instructors use around the lessons.

  checks/           exercise checkers (`from fsdp_course.classroom.checks import check_ddp`)
  exercises.py      builds exercises/ from solutions/ (solution blocks become stubs)
  grading.py        the instructor's `fsdp-course grade` (nbgrader, sandboxed)
  autograde.py      nbgrader's autograde step, run per notebook
  timed_execute.py  notebook execution with a time limit and a clean kill
  notebooks.py      `below()` for lessons; re-run and save notebooks (make notebooks)
  cli.py            the `fsdp-course` command;   lab.py   `make lab`
"""

"""The classroom (floor 4): what students and instructors use around the lessons.

Design notes: docs/CLASSROOM.md, "The classroom", `__init__.py`.
"""

"""What the lessons run to show an idea, kept out of their cells: measurement runs, training loops, their tables.

One module per subject (digit_training: lessons 08-09; pitfalls: 10; reproduce: 05 and 09; units: 07). They sit
above the library they call (fsdp, engines, runtime, memory, viz) and below nothing: no library module imports them.
"""

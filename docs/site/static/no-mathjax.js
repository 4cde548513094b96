// The lessons write their formulas in Unicode: the site loads no MathJax (see conf.py).

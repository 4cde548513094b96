"""Sphinx configuration of the course's website (`make site`): MyST-NB renders the saved notebooks, never runs them.

One configuration for both languages: docs/site/build.py stages each language's pages and passes `-D language=`.
Nothing is fetched at build or read time: no MathJax, no widget JavaScript, the theme's own bundled assets."""

project = "fsdp-course"
author = "fsdp-course"
extensions = ["myst_nb", "sphinx_design"]
nb_execution_mode = "off"  # the outputs are the notebooks' saved ones, checked by nbval in make test
nb_ipywidgets_js = {}  # a saved widget renders as its text; no require.js or widget manager from a CDN
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
myst_enable_extensions = ["colon_fence"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]  # a notebook's heading levels are its own
exclude_patterns = ["_build"]
html_theme = "sphinx_book_theme"
html_title = "FSDP from scratch"
html_static_path = ["static"]
html_css_files = ["site.css"]
html_js_files = ["fold.js", "search-zh.js"]
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False}
html_copy_source = False
html_show_sourcelink = False
mathjax_path = "no-mathjax.js"  # Sphinx insists on a path; the lessons write formulas in Unicode, so no page loads it
html_context = {"default_mode": "light"}  # without it the theme logs "invalid theme mode" on a first visit

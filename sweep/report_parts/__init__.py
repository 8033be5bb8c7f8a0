"""What a report is built from: the page and a kind's part of it (:mod:`.page`), and the figures (:mod:`.figures`).
Below the experiment kinds, whose report parts use them, and the report (``headsweep.sweep.reporting``), which
assembles the kinds' parts into one page."""

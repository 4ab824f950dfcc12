"""What people see: a run's status, the volunteer's live display, figures and the HTML report."""

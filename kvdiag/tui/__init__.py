"""The Textual app behind `kvdiag top`."""

"""The report model: options, grouping and the text, markdown, CSV and JSON renderings."""

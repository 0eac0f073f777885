"""Storage: SQLAlchemy Core tables, engines, migrations and the repository functions.

SQLite (embedded, ``wattwatch up``) and PostgreSQL (production) run the same code; the few
statements that differ (upserts, max/min of two values) are chosen by dialect in ``repository``.
"""

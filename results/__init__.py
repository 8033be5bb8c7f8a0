"""The results store: table schemas, atomic Parquet writing, and SQL queries."""

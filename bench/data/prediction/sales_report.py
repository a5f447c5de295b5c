import csv
import statistics
from collections import defaultdict
from datetime import date


def read_sales(path, delimiter=","):
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        for line_number, row in enumerate(reader, start=2):
            try:
                rows.append(
                    {
                        "day": date.fromisoformat(row["date"]),
                        "region": row["region"].strip(),
                        "product": row["product"].strip(),
                        "units": int(row["units"]),
                        "price": float(row["price"]),
                    }
                )
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{line_number}: bad row: {e}") from None
    return rows


def revenue(row):
    return row["units"] * row["price"]


def totals_by(rows, key):
    totals = defaultdict(float)
    for row in rows:
        totals[row[key]] += revenue(row)
    return dict(sorted(totals.items(), key=lambda item: item[1], reverse=True))


def monthly_totals(rows):
    totals = defaultdict(float)
    for row in rows:
        month = row["day"].strftime("%Y-%m")
        totals[month] += revenue(row)
    return dict(sorted(totals.items()))


def best_day(rows):
    by_day = defaultdict(float)
    for row in rows:
        by_day[row["day"]] += revenue(row)
    if not by_day:
        return None
    return max(by_day.items(), key=lambda item: item[1])


def summary(rows):
    amounts = [revenue(row) for row in rows]
    if not amounts:
        return {"count": 0, "total": 0.0, "mean": 0.0, "median": 0.0}
    return {
        "count": len(amounts),
        "total": round(sum(amounts), 2),
        "mean": round(statistics.mean(amounts), 2),
        "median": round(statistics.median(amounts), 2),
    }


def write_report(rows, path):
    with open(path, "w") as f:
        f.write("# Sales report\n\n")
        stats = summary(rows)
        f.write(f"Sales: {stats['count']}, total {stats['total']:.2f}, mean {stats['mean']:.2f}\n\n")
        f.write("## By region\n\n")
        for region, total in totals_by(rows, "region").items():
            f.write(f"- {region}: {total:.2f}\n")
        f.write("\n## By product\n\n")
        for product, total in totals_by(rows, "product").items():
            f.write(f"- {product}: {total:.2f}\n")
        f.write("\n## By month\n\n")
        for month, total in monthly_totals(rows).items():
            f.write(f"- {month}: {total:.2f}\n")
        day = best_day(rows)
        if day is not None:
            f.write(f"\nBest day: {day[0].isoformat()} ({day[1]:.2f})\n")


if __name__ == "__main__":
    import sys

    write_report(read_sales(sys.argv[1]), sys.argv[2])

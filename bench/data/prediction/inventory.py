from dataclasses import dataclass, field


class OutOfStock(Exception):
    pass


@dataclass
class Item:
    sku: str
    name: str
    price: float
    qty: int = 0
    tags: set = field(default_factory=set)

    def value(self):
        return self.price * self.qty


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, sku, name, price, qty=0, tags=()):
        if sku in self.items:
            raise ValueError(f"duplicate sku: {sku}")
        if price < 0:
            raise ValueError("price must not be negative")
        item = Item(sku, name, price, qty, set(tags))
        self.items[sku] = item
        return item

    def restock(self, sku, qty):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self.items[sku].qty += qty

    def remove(self, sku, qty):
        item = self.items[sku]
        if item.qty < qty:
            raise OutOfStock(f"{sku}: have {item.qty}, need {qty}")
        item.qty -= qty

    def total_value(self):
        return sum(item.value() for item in self.items.values())

    def low_stock(self, threshold=5):
        return sorted(
            (item for item in self.items.values() if item.qty < threshold),
            key=lambda item: item.qty,
        )

    def find(self, tag=None, max_price=None):
        found = []
        for item in self.items.values():
            if tag is not None and tag not in item.tags:
                continue
            if max_price is not None and item.price > max_price:
                continue
            found.append(item)
        return found

    def to_rows(self):
        return [
            {"sku": item.sku, "name": item.name, "price": item.price, "qty": item.qty}
            for item in sorted(self.items.values(), key=lambda item: item.sku)
        ]


def load_inventory(rows):
    inventory = Inventory()
    for row in rows:
        inventory.add(row["sku"], row["name"], float(row["price"]), int(row.get("qty", 0)))
    return inventory

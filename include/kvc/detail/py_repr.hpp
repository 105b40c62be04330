#pragma once
// Python's repr of the values kvc's messages quote, so that a message reads as transformers'
// does: strings (repr(str), with its quoting and escapes), floats, lists of ints, and tuples,
// lists and sets of strings; and of a parsed JSON value (py_json_repr, py_json_str, templates on
// the JSON type, so this header does not include a JSON library).

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::detail {

// repr(str): single quotes unless the text has a ' and no "; backslash, the quote, \t \n \r
// escaped; other C0/C1 controls, DEL and U+00AD as \xNN. Other printable UTF-8 passes through
// (Python also escapes the remaining non-printable code points, which kvc does not classify).
inline std::string py_str_repr(std::string_view s) {
  const bool single = s.find('\'') != std::string_view::npos;
  const bool dbl = s.find('"') != std::string_view::npos;
  const char quote = (single && !dbl) ? '"' : '\'';
  constexpr char hex[] = "0123456789abcdef";
  const auto hex_escape = [&](std::string& out, unsigned c) {
    out += "\\x";
    out += hex[(c >> 4) & 0xF];
    out += hex[c & 0xF];
  };
  std::string out(1, quote);
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == static_cast<unsigned char>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      hex_escape(out, c);
    } else if (c == 0xC2 && i + 1 < s.size()) {
      const auto next = static_cast<unsigned char>(s[i + 1]);
      if ((next >= 0x80 && next <= 0x9F) || next == 0xAD) {
        hex_escape(out, next);
        ++i;
      } else {
        out += static_cast<char>(c);
      }
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

// repr(float): the shortest round-trip digits, fixed notation when -4 < exponent + 1 <= 16
// (with ".0" for whole numbers), otherwise d.ddde+XX.
inline std::string py_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(res.ptr - buf));  // "-1.25e+02", "0e+00"
  std::string out;
  if (!sci.empty() && sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const auto epos = sci.find('e');
  std::string digits;
  for (const char c : sci.substr(0, epos))
    if (c != '.') digits += c;
  const int exp = std::atoi(std::string(sci.substr(epos + 1)).c_str());
  const int decpt = exp + 1;
  const auto ndigits = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (ndigits > 1) {
      out += '.';
      out.append(digits, 1);
    }
    out += exp < 0 ? "e-" : "e+";
    const int a = std::abs(exp);
    if (a < 10) out += '0';
    out += std::to_string(a);
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<std::size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= ndigits) {
    out += digits;
    out.append(static_cast<std::size_t>(decpt - ndigits), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<std::size_t>(decpt));
    out += '.';
    out.append(digits, static_cast<std::size_t>(decpt));
  }
  return out;
}

// repr() of the Python value json.load gives for `j`: None, True/False, ints, floats, 'str',
// [a, b] and {'k': v} (in the document's key order when J keeps it).
template <class J>
std::string py_json_repr(const J& j) {
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.template get<bool>() ? "True" : "False";
  if (j.is_number_unsigned()) return std::to_string(j.template get<std::uint64_t>());
  if (j.is_number_integer()) return std::to_string(j.template get<std::int64_t>());
  if (j.is_number_float()) return py_float_repr(j.template get<double>());
  if (j.is_string()) return py_str_repr(j.template get_ref<const typename J::string_t&>());
  std::string out;
  if (j.is_array()) {
    out = "[";
    bool first = true;
    for (const auto& e : j) {
      if (!first) out += ", ";
      first = false;
      out += py_json_repr(e);
    }
    return out + "]";
  }
  if (j.is_object()) {
    out = "{";
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += py_str_repr(it.key());
      out += ": ";
      out += py_json_repr(it.value());
    }
    return out + "}";
  }
  return j.dump();  // binary / discarded: never produced by parsing
}

// str(): a string prints bare, everything else as its repr.
template <class J>
std::string py_json_str(const J& j) {
  if (j.is_string()) return j.template get<std::string>();
  return py_json_repr(j);
}

// Python's repr of a list of ints: [1, 2, 3].
inline std::string py_list(const std::vector<std::int64_t>& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

// The strings of `values` as Python prints them in a sequence: each repr'd, ", " between them,
// inside `open` and `close`; a one-element tuple gets its trailing comma.
template <class Range>
std::string py_str_sequence(const Range& values, char open, char close, bool tuple) {
  std::string out(1, open);
  std::size_t n = 0;
  for (const auto& v : values) {
    if (n++) out += ", ";
    out += py_str_repr(std::string_view(v));
  }
  if (tuple && n == 1) out += ',';
  out += close;
  return out;
}

// ('a', 'b'), ('a',) for one element, () for none.
template <class Range>
std::string py_str_tuple(const Range& values) {
  return py_str_sequence(values, '(', ')', true);
}

// ['a', 'b'].
template <class Range>
std::string py_str_list(const Range& values) {
  return py_str_sequence(values, '[', ']', false);
}

// {'a', 'b'}, elements sorted; set() when empty.
inline std::string py_str_set(const std::set<std::string>& values) {
  return values.empty() ? std::string("set()") : py_str_sequence(values, '{', '}', false);
}

}  // namespace kvc::detail
